"""polymq: one gateway speaking NSQ V2, MQKS, PHPMQ, PZQ and eMQP over one shared queue engine."""

__version__ = "0.1.0"
