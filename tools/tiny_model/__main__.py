"""`python -m tools.tiny_model PATH`: build the tiny model into PATH (see build.py)."""

from tools.tiny_model.build import main

main()
