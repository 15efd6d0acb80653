"""tools/perf/ab_stats.py on the CPU (host clock): the order calls run in, what is timed and
the block statistics."""

from __future__ import annotations

import time

import pytest
import torch

from ab_stats import (BLOCK_ORDER, b_minus_a, back_to_back_rounds, block_rounds, blocks_by_position,
                      interleaved_rounds, position_corrected)

CPU = torch.device("cpu")


def test_block_rounds_time_blocks_in_thue_morse_order_after_preheat_and_warmup():
    assert BLOCK_ORDER == "ABBABAAB"  # linear and quadratic drifts cancel: positions 1 4 6 7 / 2 3 5 8
    pos = {c: [i + 1 for i, x in enumerate(BLOCK_ORDER) if x == c] for c in "AB"}
    assert sum(pos["A"]) == sum(pos["B"]) and sum(p * p for p in pos["A"]) == sum(p * p for p in pos["B"])
    calls, setups = [], []
    variants = [("a", lambda: calls.append("a")), ("b", lambda: (calls.append("b"), time.sleep(0.002)))]
    times = block_rounds(variants, 3, None, CPU, warmup=2, preheat=3, setup=lambda: setups.append(len(calls)))
    block = lambda c: [c] * 5  # noqa: E731  (each block: 2 untimed, then 3 timed calls)
    assert calls == ["a", "b", "a"] + sum((block(c.lower()) for c in BLOCK_ORDER), [])
    assert setups == list(range(len(calls)))  # setup before every call, the preheat's too
    assert sorted(times) == ["a", "b"] and len(times["a"]) == len(times["b"]) == 12
    assert all(t >= 2.0 for t in times["b"]) and all(0 <= t < 2.0 for t in times["a"])
    calls.clear()
    block_rounds(variants, 1, None, CPU, warmup=0, order="ABBA")
    assert calls == ["a", "b", "b", "a"]
    with pytest.raises(ValueError, match="letters A and B"):
        block_rounds(variants, 1, None, CPU, order="AAA")
    with pytest.raises(ValueError, match="would merge"):
        block_rounds([variants[0], variants[0]], 1, None, CPU)


def test_block_differences_put_blocks_back_in_order_and_correct_for_positions():
    # Two calls per block, the block's median between them; A ran at positions 1 4 6 7, B at 2 3 5 8.
    spread = lambda blocks: sum(([m - 0.01, m + 0.01] for m in blocks), [])  # noqa: E731
    blocks = blocks_by_position(spread([6.2, 5.8, 5.7, 5.7]), spread([5.6, 5.6, 5.7, 5.8]), 2)
    assert blocks == pytest.approx([6.2, 5.6, 5.6, 5.8, 5.7, 5.7, 5.7, 5.8])
    assert b_minus_a(blocks) == pytest.approx(5.675 - 5.85)
    assert b_minus_a(blocks, skip_first=True) == pytest.approx(5.675 - (5.8 + 5.7 + 5.7) / 3)
    with pytest.raises(ValueError, match="expected 4 blocks x 2 rounds"):
        blocks_by_position([1.0] * 7, [1.0] * 8, 2)
    # Runs that share a position profile (first block slow, second and third fast) and differ by
    # B - A of 0, +0.1, -0.1 and +0.2: the correction recovers those, where the raw means do not.
    profile = [0.3, -0.15, -0.12, 0.05, 0.05, -0.1, -0.08, 0.05]
    effects = [0.0, 0.1, -0.1, 0.2]
    runs = [[5.5 + p + (e if letter == "B" else 0.0) for p, letter in zip(profile, "ABBABAAB")] for e in effects]
    raw = [b_minus_a(r) for r in runs]
    assert raw == pytest.approx([e - 0.085 for e in effects])  # B's positions run 0.085 ms faster here
    corrected = position_corrected(runs)
    # The other runs' own effects stay in their profile: exact up to their mean effect's share.
    for got, e in zip(corrected, effects):
        others = sum(effects) - e
        assert got == pytest.approx(e - others / 3, abs=1e-9)
    assert [b - a for a, b in zip(corrected, corrected[1:])] == pytest.approx(
        [(b - a) * 4 / 3 for a, b in zip(effects, effects[1:])])
    with pytest.raises(ValueError, match="at least three"):
        position_corrected(runs[:2])


def test_back_to_back_rounds_time_each_call_from_the_previous_end():
    calls, setups = [], []
    sleeps = iter([0.0] * 3 + [0.003, 0.001, 0.003, 0.001])  # 2 warmup + 1 untimed lead, then 4 timed

    def call():
        calls.append("c")
        time.sleep(next(sleeps))
    times = back_to_back_rounds("c", call, 4, None, CPU, warmup=2, setup=lambda: setups.append(len(calls)))
    assert len(calls) == 7 and setups == list(range(7))  # setup before every call, timed or not
    got = times["c"]
    assert len(got) == 4
    assert got[0] >= 3.0 and got[2] >= 3.0 and 1.0 <= got[1] < 3.0 and 1.0 <= got[3] < 3.0, got
    variants = [("a", lambda: None), ("b", lambda: None)]
    both = block_rounds(variants, 2, None, CPU, warmup=1, back_to_back=True)
    assert len(both["a"]) == len(both["b"]) == 8
    with pytest.raises(ValueError, match="choose one"):
        block_rounds(variants, 1, None, CPU, back_to_back=True, host_lead_ms=1.0)


def test_interleaved_rounds_alternate_the_order_and_drop_the_warmup():
    calls, setups = [], []
    variants = [("a", lambda: calls.append("a")), ("b", lambda: (calls.append("b"), time.sleep(0.002)))]
    times = interleaved_rounds(variants, 3, None, CPU, warmup=2, setup=lambda: setups.append(len(calls)))
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # 5 rounds, order flips each
    assert setups == list(range(10))  # before every call, untimed
    assert sorted(times) == ["a", "b"] and len(times["a"]) == len(times["b"]) == 3
    assert all(t >= 2.0 for t in times["b"]) and all(0 <= t < 2.0 for t in times["a"])
