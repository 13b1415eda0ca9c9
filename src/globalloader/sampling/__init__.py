"""Index-space orders: epoch permutations, two-level sharding and the joint multi-job sampler.

`sampling.coupled` (the seed slides' two-job lock-step rule) is a reference the sampler
benchmark compares against, not part of the public surface.
"""

from globalloader.sampling.joint import JointSampler

__all__ = ["JointSampler"]
