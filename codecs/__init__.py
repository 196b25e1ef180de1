"""Sans-IO wire codecs, one module per protocol. Imports nothing of polymq."""
