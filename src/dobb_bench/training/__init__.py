"""The training room: the GPT model, corpora and batches, the resumable training loop (checkpoints,
run statistics), ``--out`` safety, child processes, and the ``train``/``compare``/``sweep`` commands.
"""
