"""Operations on checkpoint directories, one module each; none builds on another."""
