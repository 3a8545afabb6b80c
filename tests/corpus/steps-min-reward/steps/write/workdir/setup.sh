touch /app/setup-ran
