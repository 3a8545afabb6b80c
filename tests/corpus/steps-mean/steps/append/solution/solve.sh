#!/bin/bash
echo "one two" > /app/out.txt
