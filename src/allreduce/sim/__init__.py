"""allreduce.sim"""
