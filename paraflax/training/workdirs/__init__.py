"""Workdirs: what a run leaves on disk and how it is read back. Checkpoints and resume
(`checkpoint`), the workdir's files and `load_trained` (`workdir`), one writer per directory
(`lock`), checksums verified on load (`checksums`), and a Hugging Face checkpoint converted to a
workdir (`convert`)."""
