"""Files of a checkpoint: atomic writes, trajectory files and headers, the index, directories, writers."""
