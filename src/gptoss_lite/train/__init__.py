"""Training: synthetic long-context data, the trainer config, and the AdamW loop (docs/training.md)."""

from gptoss_lite.train.config import TrainConfig, load_train_config
from gptoss_lite.train.data import SyntheticRetrievalData

__all__ = ["TrainConfig", "load_train_config", "SyntheticRetrievalData", "train"]


def train(*args, **kwargs):
    """Run the trainer (`gptoss_lite.train.loop.train`); imported lazily so configs load without torch work."""
    from gptoss_lite.train.loop import train as _train

    return _train(*args, **kwargs)
