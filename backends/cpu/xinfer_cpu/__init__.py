"""xinfer's CPU backend: plain torch, the reference for every other backend."""
