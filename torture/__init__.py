"""`polymq torture`: every protocol's publishers and consumers at once against a gateway the run
starts, kills with SIGKILL and restarts on the same store, then a drain and a count of what was
acknowledged, delivered, lost, duplicated and unexpected (docs/testing.md). Loaded only when the
command is asked for: `polymq serve` never imports it.
"""
