package fat

import "time"

// FAT stores local times without a zone. Linux's vfat turns them into
// Unix times with fat_time_fat2unix, shifting by the kernel's time zone
// (sys_tz, unless the mount says tz=UTC or time_offset=): sys_tz is 0,
// UTC, wherever the hardware clock keeps UTC, as systemd sets it up, so
// UTC is what this package takes. The arithmetic is the kernel's, out of
// range fields included (month 0 counts as 1, months 13-15 add no days,
// seconds past 59 carry), so a damaged date reads as Linux shows it.

// daysBefore is the days of a non-leap year before the first of each
// month (index 1-12; 0 and 13-15 count none), as Linux's days_in_year.
var daysBefore = [16]int64{0, 0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334, 0, 0, 0}

const (
	yearOf2100 = 120        // years since 1980; 2100 is no leap year
	days1970To = 365*10 + 2 // 1970-01-01 to 1980-01-01
	secsPerDay = 24 * 60 * 60
)

// fatTime is a FAT date and time (and centiseconds, 0-199) in UTC.
func fatTime(t, d uint16, cs byte) time.Time {
	year := int64(d >> 9)
	month := max(1, int64(d>>5&0xF))
	day := max(1, int64(d&0x1F)) - 1
	leap := (year + 3) / 4
	if year > yearOf2100 {
		leap--
	}
	if year&3 == 0 && year != yearOf2100 && month > 2 {
		leap++
	}
	s := int64(t&0x1F)*2 + int64(t>>5&0x3F)*60 + int64(t>>11)*3600
	s += (year*365 + leap + daysBefore[month] + day + days1970To) * secsPerDay
	return time.Unix(s+int64(cs/100), int64(cs%100)*10_000_000).UTC()
}
