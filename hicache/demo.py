"""A small CPU demo of the core: insert, write-through, evict across tiers, match, status.

Run: ``python -m hicache.demo``. Moves no bytes (the core only does bookkeeping); it shows
how a prompt's pages travel L1 -> L2 -> L3 and come back, and prints ``status()``.
"""

from __future__ import annotations

import json
import random
import sys

from hicache.core import CacheCore, TierSizes
from hicache.flags import ArgParser, given_flags, int_between, integer, nonneg_int
from hicache.spec.model import Direction, Tier

MAX_PROMPT_TOKENS = 1_000_000  # a few seconds and a few hundred MB of Python ints


def _line(core: CacheCore, label: str, prompt: tuple[int, ...]) -> None:
    l1, l2, l3 = core.match(prompt).lengths
    print(f"  {label:<38} hit L1={l1:>4}  L2={l2:>4}  L3={l3:>4}")


def main(argv: list[str] | None = None) -> None:
    ap = ArgParser("python -m hicache.demo", __doc__)
    ap.add_argument("--page-size", type=int_between(1, 1 << 16), default=16, metavar="N", help="tokens per page")
    ap.add_argument(
        "--prompt-tokens", type=integer, default=1000, help=f"tokens per prompt (>= 2 pages, <= {MAX_PROMPT_TOKENS:,})"
    )
    ap.add_argument("--seed", type=nonneg_int, default=0, help="random seed of the prompts")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    ps = args.page_size
    if args.prompt_tokens < 2 * ps:
        if "prompt_tokens" in given_flags(ap, argv):
            ap.error(f"--prompt-tokens {args.prompt_tokens}: must be at least two pages ({2 * ps} tokens)")
        # NOTE: name the flag the user wrote, not the default it collides with
        n = args.prompt_tokens
        ap.error(f"--page-size {ps}: must be at most {n // 2} (the {n}-token prompt must hold two pages)")
    if args.prompt_tokens > MAX_PROMPT_TOKENS:
        ap.error(
            f"--prompt-tokens {args.prompt_tokens}: at most {MAX_PROMPT_TOKENS} (the demo holds every token in memory)"
        )
    rng = random.Random(args.seed)
    need = args.prompt_tokens // ps
    # NOTE: L1 holds both prompts: with less, B's hit pins the run it shares with A, and for
    # an odd page count nothing of A could then be evicted to make room for B.
    core = CacheCore(ps, TierSizes(l1_pages=2 * need, l2_pages=2 * need, l3_pages=4 * need), tracing=True)
    system = tuple(rng.randrange(32000) for _ in range(args.prompt_tokens // 2))
    a = system + tuple(rng.randrange(32000) for _ in range(args.prompt_tokens - len(system)))
    b = system + tuple(rng.randrange(32000) for _ in range(args.prompt_tokens - len(system)))

    print(f"hicache core demo: page size {ps}, prompts of {args.prompt_tokens} tokens sharing {len(system)}")
    for name, prompt in (("A", a), ("B", b)):
        hit = core.match(prompt)
        lease = core.lock(hit.l1)
        have = hit.l1.length // ps
        pages = core.allocate_l1(len(prompt) // ps - have)
        if pages is None:
            core.evict(Tier.L1, len(prompt) // ps - have - core.l1.num_free)
            pages = core.allocate_l1(len(prompt) // ps - have)
        assert pages is not None
        result = core.insert(prompt, core.pages_l1(hit.l1) + pages)
        core.release(lease)
        core.free_private(result.rejected)
        _line(core, f"prefill {name} (recompute {len(prompt) - hit.l1.length})", prompt)
        for d in (Direction.D2H, Direction.H2S):  # write-through, completing at once here
            transfer = core.start(d, result.node)
            if transfer is not None:
                core.complete(transfer)
        _line(core, f"after write-through of {name}", prompt)
    core.evict(Tier.L1, 10**9)
    _line(core, "A after evicting all of L1", a)
    core.evict(Tier.L2, 10**9)
    _line(core, "A after evicting all of L2", a)
    hit = core.match(a)
    s2h = core.start(Direction.S2H, hit.l3.node)
    assert s2h is not None
    core.complete(s2h)
    _line(core, "A after S2H (promotion to L2)", a)
    h2d = core.start(Direction.H2D, core.match(a).l2.node)
    assert h2d is not None
    core.complete(h2d)
    _line(core, "A after H2D (restore to L1)", a)
    core.check_integrity()
    print("check_integrity(): passed")
    covered = len(core.tree.coverage)
    print(f"spec transitions exercised: {covered}")
    print("status():")
    print(json.dumps(core.status().to_dict(), indent=1))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # python -m hicache.demo | head
        sys.stderr.close()
