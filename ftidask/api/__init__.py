"""What the user calls: ``ftidask.init``, the Context, the resilient-loop decorator, logging set-up.
"""
