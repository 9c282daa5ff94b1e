"""lmdb"""
