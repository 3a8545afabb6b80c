#!/bin/bash
test -f /app/setup-ran && echo wrong > /app/out.txt
