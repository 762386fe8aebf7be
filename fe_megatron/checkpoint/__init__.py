"""Run directories and checkpoints, for every engine and every reader: the files and their
checksum manifest (`files`), the run info each checkpoint records, and the resume guards
(`resume_guard`), the commit every engine's save goes through (`commit`), the ``--load`` and
``--save`` rules (`resume`) and the reader every consumer uses (`reader`).  Nothing here imports
an engine; the engines write their own tensors into the folders this package commits."""
