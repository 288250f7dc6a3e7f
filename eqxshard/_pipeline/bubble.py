"""The bubble: the share of a pipeline's ticks a stage idles, waiting for its first input
or for the last stage to finish."""

from __future__ import annotations


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """`(S-1)/(M*R+S-1)`: the share of its ticks each of `S` stages idles when `M`
    microbatches go round the stages `R` times (`R=1`: GPipe; more: circular), each tick
    one chunk of layers on one microbatch. The run takes `M*R+S-1` ticks of which every
    stage works `M*R`. The MPMD orders (1F1B and GPipe, forwards and backwards taking a
    tick each) idle the same share with `R=1`."""
    return (stages - 1) / (microbatches * repeats + stages - 1)
