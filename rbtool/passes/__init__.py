"""Deep passes: one function over many files on worker processes (`pool`) and torchrun ranks
(`ranks`), resumable from a journal (`journal`)."""
