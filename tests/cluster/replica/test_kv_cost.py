"""The pull-or-compute cost model: priors that try pulling, figures learned from
measurements (medians of the recent ones), and the decision following them."""

from __future__ import annotations

from cluster.replica.kv_cost import LARGE_PULL_BYTES, MIN_PREFILL_TOKENS, WINDOW, PullCost

MIB = 1 << 20


def test_the_priors_pull_a_long_prefix_and_compute_a_short_one() -> None:
    cost = PullCost()
    assert cost.worth_pulling(tokens=1024, nbytes=64 * MIB)
    assert not cost.worth_pulling(tokens=2, nbytes=64 * 1024)  # its fixed cost dominates


def test_slow_pulls_turn_the_decision_to_compute() -> None:
    cost = PullCost(prefill_tokens_per_s=10_000.0)
    assert cost.worth_pulling(1024, 64 * MIB)
    for _ in range(3):
        cost.observe_pull(64 * MIB, 2.0)  # 32 MiB/s: slower than computing 1024 tokens
    assert cost.pull_bytes_per_s < 40 * MIB
    assert not cost.worth_pulling(1024, 64 * MIB)
    assert cost.pulls_seen == 3


def test_small_pulls_learn_the_fixed_cost_not_the_rate() -> None:
    cost = PullCost()
    rate = cost.pull_bytes_per_s
    for _ in range(20):
        cost.observe_pull(LARGE_PULL_BYTES // 4, 0.05)
    assert cost.pull_bytes_per_s == rate
    assert 0.04 < cost.pull_overhead_s < 0.05


def test_prefill_rate_is_learned_from_prefills_long_enough_to_tell() -> None:
    cost = PullCost()
    cost.observe_prefill(MIN_PREFILL_TOKENS - 1, 10.0)  # too short: ignored
    assert cost.prefills_seen == 0
    for _ in range(3):
        cost.observe_prefill(4000, 0.1)  # 40k tokens/s: a fast prefill
    assert cost.prefill_tokens_per_s == 40_000
    # Now 64 MiB at the prior 2 GB/s (~34 ms) loses to computing 1024 tokens (~26 ms).
    assert not cost.worth_pulling(1024, 64 * MIB)
    assert cost.worth_pulling(4096, 64 * MIB)


def test_a_cold_start_and_a_lucky_pull_do_not_move_the_figures() -> None:
    """Medians: a first prefill 20x slower (a cold engine) and one pull 50x faster than the
    others are outvoted by the rest."""
    cost = PullCost()
    cost.observe_prefill(1000, 1.0)  # cold: 1k tokens/s
    for _ in range(2):
        cost.observe_prefill(1000, 0.05)  # warm: 20k tokens/s
    assert cost.prefill_tokens_per_s == 20_000
    for seconds in (0.2, 0.004, 0.2):  # 64 MiB: ~335 MB/s, then one lucky 17 GB/s
        cost.observe_pull(64 * MIB, cost.pull_overhead_s + seconds)
    assert cost.pull_bytes_per_s < 400e6


def test_the_figures_follow_the_recent_measurements() -> None:
    cost = PullCost()
    for _ in range(WINDOW):
        cost.observe_prefill(1000, 0.1)  # 10k tokens/s
    for _ in range(WINDOW // 2 + 1):
        cost.observe_prefill(1000, 0.5)  # then the replica is loaded: 2k tokens/s
    assert cost.prefill_tokens_per_s == 2000


def test_prefills_of_several_lengths_give_the_marginal_rate_and_the_fixed_cost() -> None:
    """5 ms per step plus 50 us per token: computing 1000 more tokens adds 50 ms, whatever
    the step costs; one cold outlier does not bend the line."""
    cost = PullCost()
    for tokens in (100, 400, 1000, 2000, 100, 400):
        cost.observe_prefill(tokens, 0.005 + tokens / 20_000)
    cost.observe_prefill(1000, 2.0)  # a cold start
    assert abs(cost.prefill_tokens_per_s - 20_000) < 1
    assert abs(cost.prefill_fixed_s - 0.005) < 1e-6
    assert abs(cost.compute_seconds(1000) - 0.05) < 1e-6
    assert abs(cost.first_token_seconds(100) - 0.01) < 1e-6


def test_a_prompt_too_short_to_pay_for_a_lookup_skips_it() -> None:
    cost = PullCost(prefill_tokens_per_s=20_000.0)
    for _ in range(3):
        cost.observe_lookup(0.004)
    assert cost.lookup_s == 0.004
    # 64 tokens compute in 3.2 ms: not even a free pull beats that after a 4 ms lookup.
    assert not cost.worth_looking_up(64, 64 * 1024)
    # Once looked up, the lookup is spent: a 2 ms pull beats 3.2 ms of computing.
    assert cost.worth_pulling(64, 0)
    assert cost.worth_looking_up(1024, 1 * MIB)
