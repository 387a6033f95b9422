// Translation unit that carries the precompiled header (see smp_pch.h).
