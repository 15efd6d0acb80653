"""A/B statistics of the performance experiments: two variants of one call timed against each
other, call by call or in blocks, and block timings corrected for where their blocks ran.

Not part of the package: the benchmarks users run time with ``megatron_mok.bench.timing``
(CUDA-event stopwatch, ranks aligned, the median of the slowest rank). Every call here is
synchronised and timed on the slowest rank the same way.

Why blocks. The H200 runs at its power cap under these loads. Alternating the variants call by
call averages their clocks: one variant's low-power phases lend clock to the other's next call,
so a variant that spends less energy per call looks no faster than one that spends more. In
blocks (many calls of one variant, after untimed calls that bring the card to the power state
that variant holds) each runs at its own clock.

Why a position correction. Blocks at some positions of the order run faster or slower whatever
the variant (the first block after the preheat runs slow; at 48 experts per GPU on two H200s
the blocks at positions 2 and 3 ran ~0.14 ms faster than their run's mean on every machine),
by as much as the changes being compared. :func:`position_corrected` subtracts the position
profile the other runs of a load share.
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_mok.bench.timing import Stopwatch, align_ranks

SLEEP_CYCLES_PER_MS = 2_000_000
"""GPU clock cycles per millisecond for ``torch.cuda._sleep`` (an H200's top clock is 1.98 GHz;
at a lower clock the same cycles last longer, which only lengthens a host lead)."""


def hold_stream(device: torch.device, host_lead_ms: float) -> None:
    """Queue a spin of about ``host_lead_ms`` on ``device``'s current stream (nothing on the CPU
    or for ``host_lead_ms <= 0``): the host then queues the next call while the GPU spins, so
    the call's events time the GPU's work alone, without the host path before its launches.
    The spin also lowers the card's duty cycle, so under a power cap the timed call runs at a
    higher clock than in steady state (both sides of the megakernel-against-torch bound ran
    ~12% faster at P = 2); :func:`back_to_back_rounds` keeps the steady state."""
    if host_lead_ms > 0 and device.type == "cuda":
        torch.cuda._sleep(int(host_lead_ms * SLEEP_CYCLES_PER_MS))


def interleaved_rounds(variants: Sequence[Tuple[str, Callable[[], object]]], rounds: int,
                       group: Optional[dist.ProcessGroup], device: torch.device, *, warmup: int = 2,
                       setup: Optional[Callable[[], None]] = None,
                       host_lead_ms: float = 0.0) -> Dict[str, List[float]]:
    """Times (name, call) variants call by call, alternating their order every round (so slow
    drifts cancel in paired differences; under a power cap so does a difference in energy per
    call: use :func:`block_rounds` for that).

    Each call runs alone: ``setup`` (untimed), the ranks meet, the call is timed, the device is
    synchronised; its time is the slowest rank's (an all-reduce MAX over ``group``). With
    ``host_lead_ms > 0`` the GPU spins that long (:func:`hold_stream`) before the start event,
    so the host path is not timed (the host queues the call meanwhile), at the price of a lower
    duty cycle and so a higher clock. Without it the time includes the host path to each launch.

    Returns:
        {name: [ms of each timed round]}, ``rounds`` values each, in round order (the first
        ``warmup`` rounds are run and dropped).
    """
    times: Dict[str, List[float]] = {name: [] for name, _ in variants}
    for r in range(rounds + warmup):
        for name, call in (variants if r % 2 == 0 else variants[::-1]):
            if setup is not None:
                setup()
            align_ranks(group, device)
            hold_stream(device, host_lead_ms)
            watch = Stopwatch(device)
            watch.mark("start")
            call()
            watch.mark("end")
            ms = torch.tensor([watch.ms("start", "end")], device=device)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
            if r >= warmup:
                times[name].append(float(ms))
    return times


LAUNCH_QUEUE_CALLS = 16
"""Untimed back-to-back calls queued between synchronisations: far below the CUDA launch
queue's depth (a megakernel call is a few launches; the host blocks in a full queue after ~100
calls)."""


def back_to_back_rounds(name: str, call: Callable[[], object], rounds: int, group: Optional[dist.ProcessGroup],
                        device: torch.device, *, warmup: int = 2,
                        setup: Optional[Callable[[], None]] = None) -> Dict[str, List[float]]:
    """Times ``call`` in steady state: ``warmup`` untimed calls, then one more and ``rounds``
    timed ones queued back to back with an event after each, as a training step queues its
    layers. A call's time is from the end of the call before it to its own end: the GPU's time
    for it while the host keeps ahead, and any gap the host leaves included. Each call's time is
    the slowest rank's (an all-reduce MAX over ``group``, after the calls). ``setup`` runs
    before every call (queued with it, so it is inside the time when it queues GPU work).

    Returns:
        {name: [ms of each timed call]}, ``rounds`` values in call order.
    """
    for i in range(warmup):
        if setup is not None:
            setup()
        call()
        if (i + 1) % LAUNCH_QUEUE_CALLS == 0 and device.type == "cuda":
            torch.cuda.synchronize(device)
    align_ranks(group, device)
    if setup is not None:
        setup()
    call()  # the GPU runs this one while the host queues the timed calls: no host path is timed
    watches = [Stopwatch(device) for _ in range(rounds + 1)]
    watches[0].mark("end")
    for r in range(rounds):
        if setup is not None:
            setup()
        call()
        watches[r + 1].mark("end")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = [Stopwatch.between(watches[r].points["end"], watches[r + 1].points["end"], device) for r in range(rounds)]
    out = torch.tensor(ms, dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return {name: out.cpu().tolist()}


BLOCK_ORDER = "ABBABAAB"
"""The default order of :func:`block_rounds`' blocks (the Thue-Morse sequence): both variants sit
at positions summing to the same and with the same sum of squares, so a drift that is linear or
quadratic in time cancels (A B B A cancels only a linear one)."""


def blocks_by_position(times_a: Sequence[float], times_b: Sequence[float], rounds: int,
                       order: str = BLOCK_ORDER) -> List[float]:
    """The block medians (ms) of :func:`block_rounds`' times of two variants, each a flat list of
    ``rounds`` calls per block in call order, put back in the order the blocks ran (``order``).

    Raises ValueError when a list does not hold ``rounds`` calls for each of its variant's
    blocks in ``order``."""
    medians = {}
    for letter, times in (("A", times_a), ("B", times_b)):
        n_blocks = order.count(letter)
        if rounds < 1 or len(times) != n_blocks * rounds:
            raise ValueError(f"variant {letter}: {len(times)} times, expected {n_blocks} blocks x {rounds} rounds")
        medians[letter] = [statistics.median(times[i * rounds:(i + 1) * rounds]) for i in range(n_blocks)]
    seen = {"A": 0, "B": 0}
    out = []
    for letter in order:
        out.append(medians[letter][seen[letter]])
        seen[letter] += 1
    return out


def b_minus_a(blocks: Sequence[float], order: str = BLOCK_ORDER, skip_first: bool = False) -> float:
    """Mean of B's blocks minus mean of A's (ms), ``blocks`` being block medians in the order
    they ran; ``skip_first`` leaves out the first block (after the preheat it runs slow
    whichever variant it is)."""
    if len(blocks) != len(order):
        raise ValueError(f"{len(blocks)} blocks for the order {order!r}")
    pairs = list(zip(order, blocks))[1 if skip_first else 0:]
    a = [m for letter, m in pairs if letter == "A"]
    b = [m for letter, m in pairs if letter == "B"]
    return statistics.fmean(b) - statistics.fmean(a)


def position_corrected(runs: Sequence[Sequence[float]], order: str = BLOCK_ORDER,
                       skip_first: bool = False) -> List[float]:
    """B - A (ms) of each of several block runs at one load, corrected for where their blocks
    ran: every position has an offset common to the runs, so from each run the mean profile of
    the *other* runs (each block minus its run's mean) is subtracted before the difference is
    taken. The profile holds the other runs' own differences too, so the more runs, and the more
    varied their changes, the better; needs at least three.

    Args:
        runs: per run, the block medians (ms) in the order they ran (:func:`blocks_by_position`).
    """
    if len(runs) < 3:
        raise ValueError(f"{len(runs)} runs: a position profile needs at least three")
    if any(len(r) != len(order) for r in runs):
        raise ValueError(f"every run must hold {len(order)} blocks for the order {order!r}")
    deviations = [[m - statistics.fmean(r) for m in r] for r in runs]
    out = []
    for i, run in enumerate(runs):
        others = [d for j, d in enumerate(deviations) if j != i]
        profile = [statistics.fmean(d[p] for d in others) for p in range(len(order))]
        out.append(b_minus_a([m - q for m, q in zip(run, profile)], order, skip_first))
    return out


def block_rounds(variants: Sequence[Tuple[str, Callable[[], object]]], rounds: int,
                 group: Optional[dist.ProcessGroup], device: torch.device, *, warmup: int = 100,
                 setup: Optional[Callable[[], None]] = None, order: str = BLOCK_ORDER,
                 preheat: int = 0, host_lead_ms: float = 0.0,
                 back_to_back: bool = False) -> Dict[str, List[float]]:
    """Times two (name, call) variants in blocks, in ``order`` (letters A and B; by default
    :data:`BLOCK_ORDER`): each block runs ``warmup`` untimed calls of one variant, then ``rounds``
    timed ones, each call alone as in :func:`interleaved_rounds`. Before the first block,
    ``preheat`` untimed calls alternate between the variants.

    Under a power cap each variant then runs at the clock its own load holds (see the module's
    docstring). Without the preheat, in blocks A B B A the variant of the first block came out
    0.11-0.16 ms (of 5.5) faster in three runs, whichever it was; with the preheat and the
    default order an A/A run differed by 0.04 ms. ``host_lead_ms``: as in
    :func:`interleaved_rounds`. ``back_to_back``: each block's calls are queued back to back
    (:func:`back_to_back_rounds`) instead of each alone.

    Returns:
        {name: [ms of each timed call]}, ``rounds`` values per block of the variant, in call
        order.
    """
    if sorted(set(order)) != ["A", "B"]:
        raise ValueError(f"order={order!r} must hold the letters A and B, and only those")
    if back_to_back and host_lead_ms > 0:
        raise ValueError("back_to_back and host_lead_ms > 0 both hide the host path; choose one")
    (name_a, call_a), (name_b, call_b) = variants
    if name_a == name_b:
        raise ValueError(f"both variants are named {name_a!r}; their times would merge")
    for i in range(preheat):
        if setup is not None:
            setup()
        (call_a if i % 2 == 0 else call_b)()
    times: Dict[str, List[float]] = {name_a: [], name_b: []}
    for letter in order:
        name, call = (name_a, call_a) if letter == "A" else (name_b, call_b)
        if back_to_back:
            times[name] += back_to_back_rounds(name, call, rounds, group, device, warmup=warmup, setup=setup)[name]
        else:
            times[name] += interleaved_rounds([(name, call)], rounds, group, device, warmup=warmup, setup=setup,
                                              host_lead_ms=host_lead_ms)[name]
    return times
