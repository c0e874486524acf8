"""The Files and Batch APIs' state and work: the SQLite store of files and batches (per-key quotas) and the
supervised worker that runs stored batches through the serving layer. Their HTTP routes are server/files.py
and server/batches.py."""
