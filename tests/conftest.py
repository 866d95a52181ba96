import os
import sys

# The shared references (tests/reference.py) import as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
