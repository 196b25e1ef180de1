"""Hand-written C for the hot loops that pyzmq's API makes costly, with the code that loads it
(`zmq_loops.py`). Imports nothing of polymq but its `COMPILED` flag: the gateway's ZeroMQ pump and
the clients both use it."""
