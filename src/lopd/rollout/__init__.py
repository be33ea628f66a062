"""Generation engines behind one interface: token-id prompts in, tokens and log-probs out."""

from lopd.rollout.engine import Generation, RolloutEngine, SamplingParams
from lopd.rollout.transformers_engine import TransformersEngine

__all__ = ["Generation", "RolloutEngine", "SamplingParams", "TransformersEngine"]
