#!/bin/bash
mkdir -p /app && echo hi > /app/answer.txt
