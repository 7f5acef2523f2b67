"""FTI-FF, the file format: fixed records, the variable table, container hashes, writer and reader.

Bytes only: nothing here knows a level, a transport or a backend.
"""
