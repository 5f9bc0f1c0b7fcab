"""The replica deployment (one engine per Mac) and its rank group when it spans several Macs."""
