"""Pure values of a run: configuration, constants, errors, array descriptions, decompositions.

Nothing here touches a file, a process or another layer of ftidask.
"""
