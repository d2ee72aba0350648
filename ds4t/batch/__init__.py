"""Sessions, eval_batch (native / ordered), and later the scheduler, persistence and server.

Imports nothing from ds4t.models: a model is used only through the interface documented on
ds4t.models.base.Model, and a step's metadata comes from the leaf module ds4t.step.
"""
