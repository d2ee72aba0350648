"""Sessions, eval_batch (native / ordered), and later the scheduler, persistence and server.

Knows nothing of model internals beyond ds4t.models.base.Model.
"""
