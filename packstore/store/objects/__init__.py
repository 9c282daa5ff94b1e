"""The object tier (``s3://BUCKET/PREFIX``): packs and banks as objects, a bounded local cache; it imports only the store
core."""
