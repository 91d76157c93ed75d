"""How fast can a discard budget be? A model of whole-answer scheduling, not a measurement.

``on_budget = "discard"`` keeps whole answers only, and an answer's length is unknown until it ends: a
scheduler must stop starting answers once those in flight are expected to fill what the budget has left,
and then wait for the longest of them. This script puts a number on that limit. It steps an idealised
server (``slots`` generations, one token each per step, nothing else costs time) and compares, on the
same lognormal lengths:

- **none**: no budget; the time until the budget's tokens were generated (the bench's baseline);
- **tokenfleet**: discard's admission rule as ``budget/lua/_lib.lua`` (``discard_full``) has it, learning
  the lengths from the answers committed so far (a copy of the rule: keep the two in step);
- **knows the lengths**: the same rule given the lengths' true distribution from the first step: what
  learning the lengths could at best give this rule (not a bound on every scheduler: one that risked
  more answers past the slack could be faster);
- **the longest answer**: a bound on *every* scheduler that keeps whole answers as the model gives them
  (not chosen by their length): the answers that fill the budget include their longest, which takes its
  length in steps however the rest are scheduled (a generation gets one token a step). Drawn as the
  longest of as many answers as it takes to reach the budget.

Both keep what the ledger keeps: an answer whose commit would pass the budget plus its 1% slack is thrown
away whole, and once what is kept and thrown away reaches the budget, what still runs is stopped and
thrown away (``budget_stops`` in ``_lib.lua``). Ratios are to ``none``; medians over seeds.

``--over-admit 1.05 1.2`` prints a second table: an alternative tokenfleet does not run, priced in waste.
The rule starts answers while they are expected to fill the budget times the factor: the budget is
reached sooner, and more answers are running, stopped and thrown away then. The table gives the time and
the GPU time spent on answers nobody keeps (as a share of the budget), with the rule as tokenfleet learns
the lengths and as it would knowing them.

    python bench/discard_limit.py                  # the cells of docs/budgets.md
    python bench/discard_limit.py --budget 10000000 --slots 1024 --mean 2000
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

DISCARD_SLACK = 0.01
DISCARD_SIGMAS = 2

#: (slots, budget, mean, sigma, max_new_tokens): the bench's budget-speed cells.
CELLS = [
    (64, 400_000, 400, 0.5, 4096),
    (256, 400_000, 400, 0.5, 4096),
    (1024, 400_000, 400, 0.5, 4096),
    (64, 400_000, 2000, 0.3, 16_000),
    (256, 400_000, 2000, 0.3, 16_000),
    (1024, 400_000, 2000, 0.3, 16_000),
    (1024, 10_000_000, 2000, 0.3, 16_000),
]


@dataclass
class Ledger:
    """What the rule reads: spent (committed + thrown away), committed lengths' sums, answers."""

    spent: int = 0
    tokens: int = 0
    tokens_sq: int = 0
    samples: int = 0


#: Whether ``n`` in flight (the next one included) would not fit: (n, ledger, live, budget, max_new).
Rule = Callable[[int, Ledger, int, int, int], bool]


def fits(spent: int, live: int, mean_need: float, margin_need: float, budget: int) -> bool:
    slack = math.floor(budget * DISCARD_SLACK)
    return spent + max(live, mean_need) <= budget and spent + max(live, margin_need) <= budget + slack


def tokenfleet_rule(n: int, led: Ledger, live: int, budget: int, max_new: int) -> bool:
    """discard_full: the committed lengths (length-biased) for as many in flight as are committed,
    max_new_tokens for each past that, or, where it is less, each at the tokens generated so far over the
    answers committed (discard_exposure); on average within the budget, two spreads within its slack."""
    return trusting_rule(n, led, live, budget, max_new, exposure=True)


def stepwise_rule(n: int, led: Ledger, live: int, budget: int, max_new: int) -> bool:
    """discard_full before the exposure estimate (before 2026-12-06): max_new_tokens for each answer in
    flight past the committed count."""
    return trusting_rule(n, led, live, budget, max_new, exposure=False)


def trusting_rule(n: int, led: Ledger, live: int, budget: int, max_new: int, exposure: bool) -> bool:
    mean = led.tokens_sq / led.tokens if led.tokens else 0.0
    spread = 0.0
    if led.samples:
        spread = math.sqrt(max(0.0, led.tokens_sq / led.samples - (led.tokens / led.samples) ** 2))
    trusted = min(n, led.samples) if mean > 0 else 0
    beyond = (n - trusted) * max_new
    expected = trusted * mean + beyond
    need = expected + DISCARD_SIGMAS * spread * math.sqrt(trusted)
    if exposure and beyond and led.samples and live:
        each = min(max_new, max(mean, (led.tokens + live) / led.samples))
        if n * each < expected:
            expected, need = n * each, n * each + DISCARD_SIGMAS * spread * math.sqrt(n)
    return not fits(led.spent, live, expected, need, budget)


def knowing_rule(mean: float, sigma: float) -> Rule:
    """The same rule, given the lognormal's true length-biased mean and spread from the start."""
    biased = mean * math.exp(sigma**2)
    spread = mean * math.sqrt(math.exp(sigma**2) - 1)

    def full(n: int, led: Ledger, live: int, budget: int, max_new: int) -> bool:
        return not fits(
            led.spent, live, n * biased, n * biased + DISCARD_SIGMAS * spread * math.sqrt(n), budget
        )

    return full


def lengths(mean: float, sigma: float, max_new: int, seed: int) -> Callable[[], int]:
    rnd = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    return lambda: min(max_new, max(1, round(rnd.lognormvariate(mu, sigma))))


def over(rule: Rule, factor: float) -> Rule:
    """``rule`` aiming at the budget times ``factor``."""

    def full(n: int, led: Ledger, live: int, budget: int, max_new: int) -> bool:
        return rule(n, led, live, round(budget * factor), max_new)

    return full


def run_budget(
    slots: int, budget: int, draw: Callable[[], int], max_new: int, rule: Rule, report: int = 1
) -> tuple[int, int, int]:
    """Steps until nothing runs, tokens kept, tokens thrown away. The rule reads the live tokens as last
    reported, every ``report`` steps (the workers' lease reports). An answer: [length, tokens so far,
    tokens as last reported]."""
    running: list[list[int]] = []
    led, steps, thrown, stopped = Ledger(), 0, 0, False
    while True:
        live = sum(r[2] for r in running)  # new answers add nothing until reported
        while not stopped and len(running) < slots:
            if rule(len(running) + 1, led, live, budget, max_new):
                break
            running.append([draw(), 0, 0])
        if not running:
            return steps, led.tokens, thrown
        steps += 1
        for r in running:
            r[1] += 1
            if steps % report == 0:
                r[2] = r[1]
        ended = [r[0] for r in running if r[1] >= r[0]]
        running = [r for r in running if r[1] < r[0]]
        for length in ended:
            if led.spent + length > budget + math.floor(budget * DISCARD_SLACK):
                # thrown away whole; what still runs is stopped (each would be thrown away too)
                thrown += length + sum(r[1] for r in running)
                led.spent += length + sum(r[1] for r in running)
                running, stopped = [], True
                break
            led.spent += length
            led.tokens += length
            led.tokens_sq += length * length
            led.samples += 1
        if running and led.spent >= budget:
            # the budget is reached: what still runs is stopped and thrown away (budget_stops)
            thrown += sum(r[1] for r in running)
            led.spent += sum(r[1] for r in running)
            running, stopped = [], True


def longest_filling(budget: int, draw: Callable[[], int]) -> int:
    """The longest of the answers drawn until their tokens reach ``budget``."""
    total = longest = 0
    while total < budget:
        length = draw()
        total += length
        longest = max(longest, length)
    return longest


def run_none(slots: int, budget: int, draw: Callable[[], int]) -> int:
    """Steps until ``budget`` tokens were generated with every slot busy."""
    want = [draw() for _ in range(slots)]
    done = [0] * slots
    generated = steps = 0
    while generated < budget:
        steps += 1
        for i in range(slots):
            done[i] += 1
            generated += 1
            if done[i] >= want[i]:
                want[i], done[i] = draw(), 0
    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int)
    p.add_argument("--budget", type=int)
    p.add_argument("--mean", type=float)
    p.add_argument("--sigma", type=float)
    p.add_argument("--max-new", type=int)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--report-steps",
        type=int,
        default=1,
        help="the live tokens the rules read are reported every this many steps (the workers' lease "
        "reports: 1 s is 100 steps of 10 ms)",
    )
    p.add_argument(
        "--over-admit",
        type=float,
        nargs="*",
        default=[],
        help="also price the alternative that stops what runs at the budget, starting this many times it",
    )
    args = p.parse_args()
    cells: list[Cell] = list(CELLS)
    if args.slots or args.budget or args.mean:
        mean = args.mean or 400
        sigma = args.sigma or (0.5 if mean < 1000 else 0.3)
        cells = [(args.slots or 256, args.budget or 400_000, mean, sigma, args.max_new or int(mean * 8))]
    print(
        "| slots | budget | mean (sigma) | max_new | tokenfleet / none (thrown away) "
        "| before the exposure estimate / none (thrown away) | knows the lengths / none "
        "| the longest answer / none (any scheduler) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for slots, budget, mean, sigma, max_new in cells:
        ours: list[float] = []
        before: list[float] = []
        known: list[float] = []
        bound: list[float] = []
        thrown: list[int] = []
        thrown_before: list[int] = []
        for seed in range(args.seeds):
            base = run_none(slots, budget, lengths(mean, sigma, max_new, seed))
            for rule, times, waste in (
                (tokenfleet_rule, ours, thrown),
                (stepwise_rule, before, thrown_before),
            ):
                s, _, t = run_budget(
                    slots, budget, lengths(mean, sigma, max_new, seed), max_new, rule, args.report_steps
                )
                times.append(s / base)
                waste.append(t)
            k, _, _ = run_budget(
                slots, budget, lengths(mean, sigma, max_new, seed), max_new, knowing_rule(mean, sigma)
            )
            known.append(k / base)
            bound.append(longest_filling(budget, lengths(mean, sigma, max_new, seed)) / base)
        print(
            f"| {slots:,} | {budget:,} | {mean:g} ({sigma:g}) | {max_new:,} "
            f"| {median(ours):.2f}x ({median(thrown):,.0f}) "
            f"| {median(before):.2f}x ({median(thrown_before):,.0f}) "
            f"| {median(known):.2f}x | {median(bound):.2f}x |",
            flush=True,
        )
    if args.over_admit:
        print_over_admit(cells, args.over_admit, args.seeds, args.report_steps)
    return 0


Cell = tuple[int, int, float, float, int]


def print_over_admit(cells: list[Cell], factors: list[float], seeds: int, report: int = 1) -> None:
    """The alternative: started up to the budget times each factor, what runs stopped at the budget."""
    print()
    heads = " | ".join(f"x{f:g}: learning / knowing (thrown away)" for f in factors)
    print(f"| slots | budget | mean (sigma) | {heads} |")
    print("|---|---|---|" + "---|" * len(factors))
    for slots, budget, mean, sigma, max_new in cells:
        row = []
        for factor in factors:
            figures: list[list[float]] = [[], [], [], []]
            for seed in range(seeds):
                base = run_none(slots, budget, lengths(mean, sigma, max_new, seed))
                for i, rule in enumerate((tokenfleet_rule, knowing_rule(mean, sigma))):
                    s, _, t = run_budget(
                        slots,
                        budget,
                        lengths(mean, sigma, max_new, seed),
                        max_new,
                        over(rule, factor),
                        report,
                    )
                    figures[2 * i].append(s / base)
                    figures[2 * i + 1].append(t / budget)
            learn, learn_w, know, know_w = (median(f) for f in figures)
            row.append(f"{learn:.2f}x ({learn_w:.1%}) / {know:.2f}x ({know_w:.1%})")
        print(f"| {slots:,} | {budget:,} | {mean:g} ({sigma:g}) | {' | '.join(row)} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
