"""Index-space orders: epoch permutations, two-level sharding and the joint multi-job sampler."""

from globalloader.sampling.coupled import coupled_pair_step
from globalloader.sampling.joint import JointSampler

__all__ = ["JointSampler", "coupled_pair_step"]
assert __all__ == sorted(__all__)
