"""Embedding models (EngineConfig.task 'embed'): a request's prompt pooled into one vector, as vLLM's pooling
runner does. `config.py` reads how a checkpoint pools, `params.py` validates what a request asks for, and
`pooler.py` pools a step's hidden states."""

from engine.pooling.config import PoolerConfig, PoolingType
from engine.pooling.params import PoolingParams

__all__ = ["PoolerConfig", "PoolingParams", "PoolingType"]
