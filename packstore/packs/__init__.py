"""packs"""
