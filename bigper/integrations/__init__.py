"""Drop-ins for RL libraries. Each lives in its own module and imports its
library only when that module is imported, so ``import bigper.integrations``
costs nothing: ``from bigper.integrations.sb3 import PrioritizedReplayBuffer``."""
