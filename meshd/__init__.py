"""meshd: several ordinary machines serving one large language model together."""

__version__ = "0.1.0"
