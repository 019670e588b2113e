"""Everything a run reads, checked before it is used.

validate (the input-validation stage every verb calls first), load (models
from hub ids, folders, GGUF, installed packages), data (text → token windows),
calibration (calibration windows and evaluation streams of a recipe), selfcal
(text the model writes itself), checks (data files), safety (where outputs
may go, what may be replaced).
"""
