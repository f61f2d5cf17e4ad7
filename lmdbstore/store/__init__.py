"""A store on disk: LMDB environments and the writer-lock protocol, the single writer, the reader and its
position table (reads by file offset), the resume ledger, and the checks applied to everything written.
"""
