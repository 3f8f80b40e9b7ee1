"""The meshd daemon: one peer, its planes wired together under one Trio nursery tree."""
