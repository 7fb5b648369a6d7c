"""commlib's foundation layer: errors, buffers, device detection, config, tags, agreement.

Everything here imports nothing of commlib above it (checked by the
import-linter ``layers`` contract in ``setup.cfg``): the transports, datatypes,
collectives and the user API all build on it.
"""
