"""Black-box protocol conformance checks that run against any server address. Imports only codecs."""
