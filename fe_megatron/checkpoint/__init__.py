"""Run directories and checkpoints, for every engine and every reader: the files and their
checksum manifest (`files`), the run info each checkpoint records, and the resume guards
(`resume_guard`).  Plain Python; the engines write their own tensors into the folders this
package commits."""
