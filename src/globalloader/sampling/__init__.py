"""Index-space orders: epoch permutations, two-level sharding and the joint multi-job sampler."""

from globalloader.sampling.joint import JointSampler

__all__ = ["JointSampler"]
