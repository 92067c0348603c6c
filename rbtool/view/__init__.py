"""Looking at a checkpoint: frames, series and cameras (`frames`), and what draws them."""
