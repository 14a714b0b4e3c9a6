# The ops/ kernel library: ops registered here are called through ops/launch/bridge.py.
