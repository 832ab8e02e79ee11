"""transforms/parallel"""
