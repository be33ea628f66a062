"""lopd: Latent On-Policy Self-Distillation of LLM agents."""

__version__ = "0.1.0"
