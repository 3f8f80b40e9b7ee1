"""Wire formats shared by every hop: the hidden-state bundle and its codec."""
