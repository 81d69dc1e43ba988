"""allreduce.topology"""
